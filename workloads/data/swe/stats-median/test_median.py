import unittest
from median import median

class TestMedian(unittest.TestCase):
    def test_even_and_odd(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)
        self.assertEqual(median([3, 1, 2]), 2)
