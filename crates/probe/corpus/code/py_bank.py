from dataclasses import dataclass, field


@dataclass
class Account:
    owner: str
    balance: float = 0.0
    history: list = field(default_factory=list)


def apply_fee(amount, rate):
    fee = round(amount * rate, 2)
    if fee < 0.5:
        fee = 0.5
    return fee


def transfer(source, target, amount, rate=0.01):
    fee = apply_fee(amount, rate)
    needed = amount + fee
    if source.balance < needed:
        return False
    source.balance -= needed
    target.balance += amount
    source.history.append(-needed)
    target.history.append(amount)
    return True


def monthly_interest(account, annual_rate):
    monthly = annual_rate / 12
    gained = account.balance * monthly
    account.balance += gained
    account.history.append(gained)
    return gained


def statement(account):
    lines = [f"Statement for {account.owner}"]
    running = 0.0
    for entry in account.history:
        running += entry
        lines.append(f"{entry:>10.2f} {running:>10.2f}")
    return "\n".join(lines)


alice = Account("alice", 500.0)
bob = Account("bob")
transfer(alice, bob, 120.0)
monthly_interest(alice, 0.03)
print(statement(alice))
