import unittest
from containers import Stack

class TestStack(unittest.TestCase):
    def test_lifo(self):
        s = Stack()
        s.push(1)
        s.push(2)
        self.assertEqual(s.pop(), 2)
        self.assertEqual(s.pop(), 1)
