/// The `status` reply: the lock state and what the mount negotiated and holds.
public struct StatusReply: Codable, Sendable, Equatable {
    public var ok = true
    public var state: LockState
    public var protectedDataAvailable: Bool
    /// Seconds of grace a lock request without one gets.
    public var grace: Double
    public var openFiles: Int
    public var pid: Int
    public var mountpoint: String
    public var failedAttempts: Int
    /// Seconds before an unlock is accepted again (0: now).
    public var retryAfter: Int
    public var classADirectIO: Bool
    public var writebackCache: Bool
    public var posixACLs: Bool
    public var subscribers: Int
    /// The mounting user's uid.
    public var owner: Int
    public var defaultClass: String
    /// Whether the AES key schedules sit in locked memory.
    public var aesMemoryLocked: Bool
    /// Hours locked after which class C goes too; null: never.
    @NullWhenAbsent public var inactivityRelock: Double?
    /// Seconds until that happens, while locked; null otherwise.
    @NullWhenAbsent public var relockIn: Int?
    /// This device's id in the store; null for a store of one device from before devices.
    @NullWhenAbsent public var deviceID: String?
    public var keySet: Int
    /// Whether another device moved to a newer key set than this daemon holds.
    public var keySetBehind: Bool
    public var tpm2: TPMStatus

    /// Whether a TPM holds part of the passcode key, and its dictionary-attack state.
    public struct TPMStatus: Codable, Sendable, Equatable {
        public var inUse: Bool
        public var lockoutCounter: Int?
        public var maxTries: Int?
        /// Seconds after which one failure is forgiven.
        public var recoveryTime: Int?
        public var lockoutRecovery: Int?
        public var inLockout: Bool?
        public var lockoutAuthSet: Bool?
        /// Why the TPM's state could not be read.
        public var error: String?

        /// No TPM in use.
        public static let notInUse = TPMStatus(inUse: false)

        public init(
            inUse: Bool, lockoutCounter: Int? = nil, maxTries: Int? = nil, recoveryTime: Int? = nil,
            lockoutRecovery: Int? = nil, inLockout: Bool? = nil, lockoutAuthSet: Bool? = nil, error: String? = nil
        ) {
            self.inUse = inUse
            self.lockoutCounter = lockoutCounter
            self.maxTries = maxTries
            self.recoveryTime = recoveryTime
            self.lockoutRecovery = lockoutRecovery
            self.inLockout = inLockout
            self.lockoutAuthSet = lockoutAuthSet
            self.error = error
        }
    }

    /// A status of `state`; the daemon fills in the rest.
    public init(state: LockState, mountpoint: String, pid: Int, owner: Int, grace: Double, defaultClass: String) {
        self.state = state
        self.protectedDataAvailable = state == .unlocked
        self.mountpoint = mountpoint
        self.pid = pid
        self.owner = owner
        self.grace = grace
        self.defaultClass = defaultClass
        openFiles = 0
        failedAttempts = 0
        retryAfter = 0
        classADirectIO = false
        writebackCache = false
        posixACLs = false
        subscribers = 0
        aesMemoryLocked = false
        keySet = 0
        keySetBehind = false
        tpm2 = .notInUse
    }
}
