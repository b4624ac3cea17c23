import unittest
from cipher import rot13

class TestRot13(unittest.TestCase):
    def test_wrap(self):
        self.assertEqual(rot13("xyz"), "klm")
        self.assertEqual(rot13(rot13("hello, world")), "hello, world")
