"""Code shared by several test suites (servers, fixtures' building blocks); not collected as tests."""
