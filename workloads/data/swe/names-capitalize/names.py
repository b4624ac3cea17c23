def capitalize_words(text):
    return text.capitalize()
