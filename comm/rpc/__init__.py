"""The one request/reply layer: envelopes, tensor framing, a service host and its clients."""
