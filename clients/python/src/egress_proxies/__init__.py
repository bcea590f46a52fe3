"""Client and Scrapy downloader middleware for the egress-proxies-operator discovery API.

``egress_proxies.client`` needs only the standard library; ``egress_proxies.scrapy_middleware``
needs Scrapy (``pip install egress-proxies[scrapy]``) and is not imported here.
"""

from .client import *  # noqa: F401,F403 (the client's public names are the package's)
from .client import __all__

__version__ = "0.1.0"
