"""The page pool of each device, as parts that own their state (see
device.py for how they fit):

- books.py   the budget, the counts, the frozen Books snapshot, admission
- pages.py   Page, and the lists of ready pages (fresh, per uid)
- zeroer.py  the background zeroer (pages given back, zeroed in batches)
- loan.py    a loan: the pages lent and the descriptors that deliver them
- device.py  DevicePool: the parts composed; lend, give back, warm, trim
"""

from .books import Books, Budget, Counts, PageIds, PoolCounters, Shortage, ZeroCounters, admit
from .device import CREATE_BATCH, DevicePool
from .loan import Loan
from .pages import Page, PageState, ReadyPages
from .zeroer import ZERO_BATCH_MAX, Zeroer

__all__ = [
    "Books", "Budget", "CREATE_BATCH", "Counts", "DevicePool", "Loan", "Page", "PageIds", "PageState", "PoolCounters",
    "ReadyPages", "Shortage", "ZERO_BATCH_MAX", "ZeroCounters", "Zeroer", "admit",
]
