import unittest
from lists import chunk

class TestChunk(unittest.TestCase):
    def test_keeps_remainder(self):
        self.assertEqual(chunk([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])
        self.assertEqual(chunk([1, 2], 2), [[1, 2]])
