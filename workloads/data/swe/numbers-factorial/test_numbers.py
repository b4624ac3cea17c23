import unittest
from numbers_ import factorial

class TestFactorial(unittest.TestCase):
    def test_base(self):
        self.assertEqual(factorial(0), 1)
        self.assertEqual(factorial(5), 120)
