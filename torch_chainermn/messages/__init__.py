"""The one message layer: how the toolkit's tensors, arrays and objects travel between ranks over
torch.distributed point to point and collectives (the backend underneath moves bytes).

- framing.py: tags, argument checks, chunking (MPI counts are C ints), the waits, raw bytes
  sent, received and broadcast in chunks.
- arrays.py: tensors and numpy arrays as raw bytes: specs, views, landing buffers, argument checks.
- objects.py: any picklable object (arrays inside travel raw) point to point and broadcast, with a
  status header so a rank that cannot take part makes the others raise instead of wait; agree().
- exchange.py: the communicator's array collectives (gather, allgather, scatter, alltoall) as one
  padded, chunked exchange.
- tensors.py: the model-parallel functions' messages (header with kind and sequence number,
  packed payload, sends not waited for, receives posted ahead).

Users: communicator.py, datasets.py, iterators.py, functions/ and links/.
"""
