import re

def parse_duration(text):
    """'1h30m', '45m', '2h' -> seconds."""
    hours = re.search(r"(\d+)h", text)
    minutes = re.search(r"(\d+)m", text)
    total = 0
    if hours:
        total += int(hours.group(1)) * 3600
    return total
