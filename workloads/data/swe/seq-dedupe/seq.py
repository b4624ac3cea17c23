def dedupe(items):
    return sorted(set(items))
