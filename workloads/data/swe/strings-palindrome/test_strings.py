import unittest
from strings import is_palindrome

class TestPalindrome(unittest.TestCase):
    def test_case_insensitive(self):
        self.assertTrue(is_palindrome("Racecar"))
        self.assertFalse(is_palindrome("Python"))
