"""The lab: a digital twin of a GPU cluster built from real parts on one machine.

``controlplane`` runs a real etcd + kube-apiserver + kube-controller-manager + kube-scheduler on
loopback; ``nodehosts`` runs real OpenSSH "node hosts" in private mount/UTS namespaces on loopback
addresses; ``assets`` finds or builds the control-plane binaries. The simulator and scenarios build
on these.

Nothing in this package may touch this machine's own swap, /etc/fstab, kubelet or services, nor
send traffic anywhere but 127.0.0.0/8. Importing it starts nothing.
"""
