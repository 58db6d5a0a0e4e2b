"""The parts behind :class:`~threadloader.service.BatchDecoder` and its sibling ``MicroBatcher``.

``queue`` holds the requests and hands out micro-batches; ``metrics`` counts answers and keeps recent
latencies; ``engine`` runs the workers and decodes a gathered micro-batch with the loader's
``BatchProducer``, answering its futures; ``batcher`` calls a user's function (a model) on a gathered
micro-batch instead. Each imports only the ones before it; ``threadloader.service`` puts them together
behind the public facades.
"""
