import unittest
from search import find

class TestFind(unittest.TestCase):
    def test_all_positions(self):
        items = [1, 3, 5, 7]
        for i, x in enumerate(items):
            self.assertEqual(find(items, x), i)
        self.assertEqual(find(items, 4), -1)
