"""Client and Scrapy downloader middleware for the egress-proxies-operator discovery API.

``egress_proxies.client`` needs only the standard library; ``egress_proxies.scrapy_middleware``
needs Scrapy (``pip install egress-proxies[scrapy]``) and is not imported here.
"""

from .client import (
    DiscoveryClient,
    DiscoveryError,
    Lease,
    LeaseNotFound,
    NoProxyAvailable,
    Proxy,
    ProxyStatus,
    StaleToken,
)

__all__ = [
    "DiscoveryClient",
    "DiscoveryError",
    "Lease",
    "LeaseNotFound",
    "NoProxyAvailable",
    "Proxy",
    "ProxyStatus",
    "StaleToken",
]
__version__ = "0.1.0"
