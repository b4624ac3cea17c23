import unittest
from leap import is_leap

class TestLeap(unittest.TestCase):
    def test_centuries(self):
        self.assertFalse(is_leap(1900))
        self.assertTrue(is_leap(2000))
        self.assertTrue(is_leap(2024))
