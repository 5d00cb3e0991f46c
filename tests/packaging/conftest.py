# The colliding application is run by test_wheel.py in a fresh virtualenv, never collected here:
# its own packages `domain`, `application`, `adapters` and `bootstrap` are the point.
collect_ignore = ["collider"]
