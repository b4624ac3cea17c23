class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, name, n):
        self.stock[name] = self.stock.get(name, 0) + n

    def remove(self, name, n):
        self.stock[name] = self.stock.get(name, 0) - n
