import unittest
from names import capitalize_words

class TestNames(unittest.TestCase):
    def test_each_word(self):
        self.assertEqual(capitalize_words("ada lovelace"), "Ada Lovelace")
