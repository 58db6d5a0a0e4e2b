"""The parts behind :class:`~threadloader.service.BatchDecoder`, one job per module.

``queue`` holds the requests and hands out micro-batches; ``metrics`` counts answers and keeps recent
latencies; ``engine`` decodes a gathered micro-batch with the loader's ``BatchProducer`` and answers its
futures. Each imports only the ones before it; ``threadloader.service`` puts them together behind the
public facade.
"""
