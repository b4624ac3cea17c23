import unittest
from units import to_fahrenheit

class TestUnits(unittest.TestCase):
    def test_boiling(self):
        self.assertAlmostEqual(to_fahrenheit(100), 212)
        self.assertAlmostEqual(to_fahrenheit(0), 32)
