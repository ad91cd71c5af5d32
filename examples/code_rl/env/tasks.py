"""The tasks of the code env: a function to write, its test file, and for the speed
variant a reference solution and a workload to time.

Each test file imports the submitted function from `solution` (the action, written
to the workspace as solution.py) and holds plain `test_*` functions: one passes when
it returns, fails when it raises. Standard library only: this module is imported by
every env.
"""

import random

TASKS = {
    "add": {
        "statement": "Write `def add(a, b)` that returns a + b (ints, floats or strings).",
        "tests": """
from solution import add

def test_small():
    assert add(1, 2) == 3

def test_negative():
    assert add(-5, 3) == -2

def test_zero():
    assert add(0, 0) == 0

def test_floats():
    assert abs(add(0.1, 0.2) - 0.3) < 1e-9

def test_big():
    assert add(10**20, 1) == 100000000000000000001

def test_strings():
    assert add("ab", "cd") == "abcd"
""",
        "reference": "def add(a, b):\n    return a + b\n",
        "workload": "for i in range(20000):\n    add(i, i)",
    },
    "is_prime": {
        "statement": "Write `def is_prime(n)` that says whether the int n is a prime (False for n < 2).",
        "tests": """
from solution import is_prime

def test_small_primes():
    assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]

def test_below_two():
    assert not is_prime(1) and not is_prime(0) and not is_prime(-7)

def test_square_of_a_prime():
    assert not is_prime(49) and not is_prime(121)

def test_big_prime():
    assert is_prime(7919)

def test_big_composite():
    assert not is_prime(7917)

def test_count_below_1000():
    assert sum(1 for n in range(1000) if is_prime(n)) == 168
""",
        "reference": (
            "def is_prime(n):\n"
            "    if n < 2:\n        return False\n"
            "    if n % 2 == 0:\n        return n == 2\n"
            "    f = 3\n"
            "    while f * f <= n:\n"
            "        if n % f == 0:\n            return False\n"
            "        f += 2\n"
            "    return True\n"
        ),
        "workload": "for i in range(1500):\n    is_prime(i)",
    },
    "fib": {
        "statement": "Write `def fib(n)` that returns the n-th Fibonacci number (fib(0) = 0, fib(1) = 1).",
        "tests": """
from solution import fib

def test_start():
    assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]

def test_ten():
    assert fib(10) == 55

def test_thirty():
    assert fib(30) == 832040

def test_ninety():
    assert fib(90) == 2880067194370816120
""",
        "reference": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "workload": "for i in range(0, 400, 2):\n    fib(i)",
    },
    "reverse_words": {
        "statement": (
            "Write `def reverse_words(s)` that returns the words of s (split on whitespace) in reverse "
            "order, joined by single spaces."
        ),
        "tests": """
from solution import reverse_words

def test_two():
    assert reverse_words("hello world") == "world hello"

def test_one():
    assert reverse_words("alone") == "alone"

def test_empty():
    assert reverse_words("") == ""

def test_spaces():
    assert reverse_words("  a   b  c ") == "c b a"

def test_tabs_and_newlines():
    assert reverse_words("x\\ty\\nz") == "z y x"
""",
        "reference": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        "workload": "for i in range(300):\n    reverse_words('the quick brown fox jumps over the lazy dog ' * 4)",
    },
    "dedupe": {
        "statement": "Write `def dedupe(xs)` that returns the list xs without repeats, keeping first occurrences in order.",
        "tests": """
from solution import dedupe

def test_plain():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]

def test_empty():
    assert dedupe([]) == []

def test_no_repeats():
    assert dedupe([1, 2, 3]) == [1, 2, 3]

def test_strings():
    assert dedupe(["b", "a", "b"]) == ["b", "a"]

def test_returns_a_list():
    assert isinstance(dedupe((1, 1)), list)

def test_long():
    assert dedupe(list(range(500)) * 3) == list(range(500))
""",
        "reference": "def dedupe(xs):\n    return list(dict.fromkeys(xs))\n",
        "workload": "data = list(range(300)) * 3\nfor i in range(50):\n    dedupe(data)",
    },
}

NAMES = sorted(TASKS)


def task_for(seed):
    """The task a reset with this seed poses, the same in every run (None: the first)."""
    return NAMES[0] if seed is None else random.Random(seed).choice(NAMES)
