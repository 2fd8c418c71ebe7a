# The project is configured in pyproject.toml; this file lets older pip versions do editable installs.
from setuptools import setup

setup()
