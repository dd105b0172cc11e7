"""The proxy's client of the daemon's pipes: sessions keyed by engine id (`client`), each
request's state and flow control (`session`), and the one exchange every surface runs
(`exchange`: queue -> first record -> stream (`token_stream`) or collect (`collected`) ->
finish), with the figures it measures (`metrics`). A surface only says how its answer looks.
"""
