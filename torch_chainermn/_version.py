# The one place the version is written: torch_chainermn.__version__ and setup.py (which reads this file
# as text, since importing the package needs the extension it builds) both take it from here.
__version__ = "0.1.0"
