def zeros(rows, cols):
    return [[0.0] * cols for _ in range(rows)]


def identity(size):
    grid = zeros(size, size)
    for i in range(size):
        grid[i][i] = 1.0
    return grid


def multiply(left, right):
    rows, inner = len(left), len(right)
    cols = len(right[0])
    out = zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            acc = 0.0
            for k in range(inner):
                acc += left[i][k] * right[k][j]
            out[i][j] = acc
    return out


def transpose(grid):
    return [list(row) for row in zip(*grid)]


def power(grid, exponent):
    result = identity(len(grid))
    base = grid
    while exponent > 0:
        if exponent % 2 == 1:
            result = multiply(result, base)
        base = multiply(base, base)
        exponent //= 2
    return result


def trace(grid):
    total = 0.0
    for i in range(len(grid)):
        total += grid[i][i]
    return total


fib = [[1, 1], [1, 0]]
print(power(fib, 10)[0][1])
print(trace(multiply(fib, transpose(fib))))
