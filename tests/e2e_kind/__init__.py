"""The kind end-to-end suite (marker e2e_kind: a real cluster made by e2e/kind/kind-up.sh), the image tests
(marker slow: containers from `make images-local`), and static checks of the images and scripts."""
