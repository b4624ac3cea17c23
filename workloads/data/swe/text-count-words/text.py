def count_words(text):
    """Number of whitespace-separated words."""
    return len(text.split(" "))
