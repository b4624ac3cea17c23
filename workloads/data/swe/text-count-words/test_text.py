import unittest
from text import count_words

class TestWords(unittest.TestCase):
    def test_spaces(self):
        self.assertEqual(count_words("hello   world"), 2)
        self.assertEqual(count_words(" a b\tc "), 3)
