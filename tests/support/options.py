"""The option objects of the daemon and the proxy, made as `tether daemon` and `tether proxy`
make them: from Settings (its defaults, with any field overridden)."""

from __future__ import annotations

from typing import Any

from daemon.options import DaemonOptions, ModelOptions
from proxy.options import ProxyOptions
from tether import options
from tether.settings import Settings


def daemon_options(**settings: Any) -> DaemonOptions:
    return options.daemon_options(Settings(**settings))


def model_options(**settings: Any) -> ModelOptions:
    return daemon_options(**settings).model


def proxy_options(**settings: Any) -> ProxyOptions:
    return options.proxy_options(Settings(**settings))
