# reliability-3 (issue 37): CLI tests of the bitwise area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.
