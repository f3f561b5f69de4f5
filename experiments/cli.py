"""What the scripts in experiments/ share: the repository root on sys.path (the training script lives there)
and an argument parser whose errors are one line. Run as `python experiments/<name>.py`, Python puts this
folder on sys.path, so `from cli import ...` finds this file."""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
