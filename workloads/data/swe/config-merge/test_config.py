import unittest
from config import merge

class TestMerge(unittest.TestCase):
    def test_later_wins(self):
        self.assertEqual(merge({"a": 1, "b": 1}, {"a": 2}), {"a": 2, "b": 1})
