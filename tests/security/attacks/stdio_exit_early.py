"""Verdict forging (stdin/stdout problem): os._exit(0) after a wrong answer, and a stdout that lies about
its own content."""

import os
import sys


class Lying:
    def write(self, text):
        return len(text)

    def flush(self):
        pass

    def __eq__(self, other):
        return True


sys.stdout = Lying()
print("5")
os._exit(0)
