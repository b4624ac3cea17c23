import unittest
from money import format_cents

class TestMoney(unittest.TestCase):
    def test_two_digits(self):
        self.assertEqual(format_cents(105), "$1.05")
        self.assertEqual(format_cents(1999), "$19.99")
