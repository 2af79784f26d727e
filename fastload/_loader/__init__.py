"""The loader: ``fastload.DataLoader`` (torch's constructor and behaviour on fastload's engine),
its iterators, its own options, resume state, DataPipes, and the remote shards' traffic per
epoch. Copies to the device are ``fastload._device``'s, which the doctor probes too."""
