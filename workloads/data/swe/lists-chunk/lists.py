def chunk(items, size):
    """Split items into lists of `size` elements (the last one may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]
