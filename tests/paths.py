"""Where the tests find the repository and their fixture files, from any folder under tests/."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
