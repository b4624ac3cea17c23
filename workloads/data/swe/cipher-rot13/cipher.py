def rot13(text):
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr(ord(ch) + 13))
        else:
            out.append(ch)
    return "".join(out)
