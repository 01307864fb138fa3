package sockowner

// UnknownGID is an Owner's GID when the socket's group could not be known
// (no process holding it is visible to the caller): never a verdict's input.
const UnknownGID = noGID
