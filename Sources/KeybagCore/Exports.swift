// The control socket's paths, protocol and client live in KeybagProtocol (no libsodium), so
// that the FileProtection library can use them; everything that imports KeybagCore sees them.
@_exported import KeybagProtocol
