def is_palindrome(text):
    """True when text reads the same backwards, ignoring case."""
    return text == text[::-1]
