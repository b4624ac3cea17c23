import unittest
from nested import flatten

class TestFlatten(unittest.TestCase):
    def test_deep(self):
        self.assertEqual(flatten([1, [2, [3, 4]], []]), [1, 2, 3, 4])
