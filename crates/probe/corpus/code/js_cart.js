// A shopping cart with quantity limits and tiered discounts.
const TAX_RATE = 0.08;

class Cart {
  constructor(maxQuantity = 10) {
    this.lines = new Map();
    this.maxQuantity = maxQuantity;
  }

  add(sku, price, quantity = 1) {
    const existing = this.lines.get(sku);
    const current = existing ? existing.quantity : 0;
    if (current + quantity > this.maxQuantity) {
      throw new Error(`too many of ${sku}`);
    }
    this.lines.set(sku, { price, quantity: current + quantity });
    return this;
  }

  subtotal() {
    let sum = 0;
    for (const line of this.lines.values()) {
      sum += line.price * line.quantity;
    }
    return sum;
  }
}

function discountFor(amount) {
  if (amount >= 200) {
    return 0.15;
  }
  if (amount >= 100) {
    return 0.05;
  }
  return 0;
}

function checkout(cart) {
  const gross = cart.subtotal();
  const discount = gross * discountFor(gross);
  const taxed = (gross - discount) * (1 + TAX_RATE);
  return Math.round(taxed * 100) / 100;
}

const cart = new Cart(5);
cart.add("pen", 1.5, 4).add("notebook", 7.25, 2);
cart.add("lamp", 120);
console.log(checkout(cart));
