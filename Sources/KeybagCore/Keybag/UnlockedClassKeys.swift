import Foundation

/// The unwrapped class keys of one key set, from a successful unlock.
public struct UnlockedClassKeys: Sendable {
    /// Class A key.
    public let classA: SecureKey
    /// Class B X25519 private key.
    public let classBSecret: SecureKey
    /// Class B public key.
    public let classBPublic: [UInt8]
    /// Class C key.
    public let classC: SecureKey
    /// The key set these keys belong to.
    public var keySet: UInt8 = 0

    /// Zeroes all three secrets.
    public func wipe() { classA.wipe(); classBSecret.wipe(); classC.wipe() }
}
