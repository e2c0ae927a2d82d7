"""A small warehouse inventory with restock thresholds."""


class Inventory:
    def __init__(self, threshold=5):
        self.stock = {}
        self.threshold = threshold
        self.log = []

    def add(self, sku, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        current = self.stock.get(sku, 0)
        self.stock[sku] = current + quantity
        self.log.append(("add", sku, quantity))

    def remove(self, sku, quantity):
        current = self.stock.get(sku, 0)
        if quantity > current:
            return False
        self.stock[sku] = current - quantity
        self.log.append(("remove", sku, quantity))
        return True

    def low_items(self):
        low = []
        for sku, count in self.stock.items():
            if count < self.threshold:
                low.append(sku)
        return sorted(low)

    def restock_order(self, batch=12):
        order = {}
        for sku in self.low_items():
            missing = self.threshold - self.stock[sku]
            packs = (missing + batch - 1) // batch
            order[sku] = packs * batch
        return order


def total_units(inventory):
    total = 0
    for count in inventory.stock.values():
        total += count
    return total


inv = Inventory(threshold=8)
inv.add("bolt", 20)
inv.add("nut", 3)
inv.remove("bolt", 15)
print(inv.restock_order(), total_units(inv))
