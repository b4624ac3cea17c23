import unittest
from web import slugify

class TestSlug(unittest.TestCase):
    def test_no_edge_dashes(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")
        self.assertEqual(slugify("  Spaces  "), "spaces")
