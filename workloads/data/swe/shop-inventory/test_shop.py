import unittest
from shop import Inventory

class TestInventory(unittest.TestCase):
    def test_no_negative(self):
        inv = Inventory()
        inv.add("apple", 2)
        with self.assertRaises(ValueError):
            inv.remove("apple", 3)
        self.assertEqual(inv.stock["apple"], 2)
