import unittest
from stats import mean

class TestMean(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([2, 4, 6]), 4.0)
        self.assertEqual(mean([5]), 5.0)
