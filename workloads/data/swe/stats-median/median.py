def median(values):
    s = sorted(values)
    return s[len(s) // 2]
