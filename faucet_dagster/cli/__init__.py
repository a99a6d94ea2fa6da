"""The ``faucet`` command line (:mod:`.main`), one module per command. The top layer: nothing in the
package imports it."""
