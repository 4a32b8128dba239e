"""The roles: plain classes, one per file, with no backend imports.

`out_of_band` is the one thing a backend reads off a worker method: that it may overtake a running
call of the same worker (it takes no lock), so a backend that serialises calls per process must
run it on a side channel.
"""


def out_of_band(method):
    method.out_of_band = True
    return method
